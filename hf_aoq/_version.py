"""The hf_aoq release. Its own module so that any part of the package (the file writers, the
model card) can name the version without importing the package root, and pyproject.toml reads
it from here."""
__version__ = "0.1.0"
