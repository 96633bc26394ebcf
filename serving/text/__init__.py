"""Generated tokens back to text: streaming detokenization (``detokenizer``) and stop
strings (``stops``)."""
