"""The repository's own facts: the lock file, what the docs state that the code decides, and the
`make bench` runner.
"""
