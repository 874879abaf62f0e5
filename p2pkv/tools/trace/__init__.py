"""``p2pkv trace``: one request's trace drawn as a timeline.

Spans come from an OTLP JSON file (``otlp``) or over OTLP/HTTP from the
exporters themselves (``receiver``); ``layout`` picks one trace and places
its spans in lanes (pure arithmetic), ``draw`` renders that as a PNG with
matplotlib, ``cli`` holds the flags. See docs/tracing.md.
"""
