"""The one error every tokenizer module raises."""


class TokenizerError(ValueError):
    """A tokenizer cannot be loaded, or rejects its input; the message names the file and what to do."""
