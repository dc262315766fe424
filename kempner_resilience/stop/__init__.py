"""The stop primitives the shutdown sequence is made of: signals, the stop agreement, watchdogs and
their GIL-free backstops, bounded teardown."""
