"""One module per schema revision, named by its readable revision id."""
