"""The one thing pyproject.toml cannot say without setuptools' experimental table: the
compiled ID reader (src/kubegpu/_idscan.c says why it exists).

It is optional: where no C compiler is at hand the install still succeeds, and
kubegpu.plugin.wire reads the same request bytes in Python to the same answer.
"""

from setuptools import Extension, setup

setup(ext_modules=[Extension("kubegpu._idscan", ["src/kubegpu/_idscan.c"], optional=True)])
