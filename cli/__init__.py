"""The parts of spec_decoding_generate.py (the command people run) that are
not the run itself: `stream` writes the tokens as they are committed, in
colour on a terminal; `report` prints the header, the stats block and the
comparison with the target alone."""
