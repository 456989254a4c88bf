"""zeroplan's imperative shell: the sharded optimizer, collectives, checkpoints and the CLI.

Heavy modules (torch) are imported on first attribute access so that
``zeroplan plan`` starts fast.
"""
