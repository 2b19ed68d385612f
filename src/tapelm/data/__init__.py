"""The data every part reads, below the experiments that train on it: the Python corpora (`corpora`), the
tokenizers (`tokenization`), examples and left-padded batches (`examples`) and the passkey document's text
(`passkey_text`)."""
