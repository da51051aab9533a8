"""What users call: ``llm.py`` (the offline ``LLM``) and ``cli.py`` (``pagedllm ...``)."""
