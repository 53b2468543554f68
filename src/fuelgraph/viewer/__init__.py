"""Views of what the optimizer did: the linked before/after graph trace, repeated-layer
detection, a layered layout and the self-contained HTML page (`fg.explain(...).to_html`)."""
