"""The cluster's chaos kit: a workload that records a history (:mod:`.history`), its checker,
and faults on real processes (:mod:`.faults`, :mod:`.proxy`), driven by
``tests/cluster/test_chaos.py`` (CI) and its soak."""
