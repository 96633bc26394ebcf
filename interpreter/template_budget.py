"""The chat-template render budget's default, apart from the renderer so the command line
can show it without importing jinja2."""

# CPU seconds one render may take: real templates render in milliseconds.
DEFAULT_BUDGET = 1.0
