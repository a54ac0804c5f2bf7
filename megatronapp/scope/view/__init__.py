"""MegaScope's view: a local web page over a capture and live generation.

``protocol`` defines what a client may send (pydantic schemas, size limits)
and how arrays travel (binary frames); ``source`` finds the capture and the
checkpoint a directory holds; ``server`` is the Starlette application with
its token, Origin allow-list and validation; ``static/`` is the page.
"""
