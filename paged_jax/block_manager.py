"""Pure-functional block manager (work in progress)."""

# Unused block-table entries hold this value. No attention backend reads them.
NULL_BLOCK = -1
