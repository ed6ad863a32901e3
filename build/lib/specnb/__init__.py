"""specnb: speculative decoding, measured. See the book for the why; each module says what it covers."""
