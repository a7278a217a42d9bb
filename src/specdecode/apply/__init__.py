"""`specdecode apply`: a file edited by a model with the file as the prediction. cli.py: the command; text.py: the
request, the answer's code block, the diff and the write; client.py: a running server asked instead of a model."""
