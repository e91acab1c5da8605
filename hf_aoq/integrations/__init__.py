"""Bridges from hf_aoq to other libraries; each module is thin and calls the layers below."""
