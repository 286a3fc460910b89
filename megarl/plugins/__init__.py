"""Users' code named in a config: `module:function` or `path/to/file.py:function` resolved to a
callable (reward functions, sample producers)."""
