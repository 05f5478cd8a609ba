"""The ``ferrymq`` command-line interface (thin over the admin and data clients)."""
