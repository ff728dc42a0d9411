"""Task plugins: prompts, tools and a pure reward, one task per file.

Plugins are looked up by registered name (``rollcall.tasks.registry``), never imported from a path
given on the command line.
"""
