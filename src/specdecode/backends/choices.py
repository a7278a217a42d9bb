"""What a user chooses about backends on the command line and in the server's options: no torch, so that the
parsers are built before anything loads it."""

BACKENDS = ("auto", "torch", "llama.cpp")
DRAFT_QUANT_CHOICES = ("auto", "none", "Q4_0", "Q8_0")  # the draft's type on llama.cpp: measured, the file's, or forced
