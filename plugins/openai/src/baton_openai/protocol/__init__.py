"""Request and response models: OpenAI's chat and completions (``openai``), its Responses API (``responses``), Anthropic's Messages API (``messages``)."""
