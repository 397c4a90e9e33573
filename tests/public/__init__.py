"""What users see: the public API and names, the docs and the commands they show, packaging, typing,
the CLI, the REPL, the pytest plugin, extras, lessons.
"""
