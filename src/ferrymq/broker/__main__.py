"""``python -m ferrymq.broker``: the same as ``ferrymq broker``."""

from ferrymq.admin.cli import main

main(["broker", *__import__("sys").argv[1:]])
