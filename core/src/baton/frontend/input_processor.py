"""Retired path (issue 31): ``InputProcessor`` left the public list.

A server tokenizes and renders chats through ``LLM`` / ``AsyncLLM`` (``tokenize``,
``render_chat``, ``tokenize_rendered_chat``, ``check_messages``, ``chat_template_variables``,
``get_tokenizer``); the class itself is internal, in ``baton.frontend.prompts``. The old name
works and warns until baton 0.3.0 (docs/stability.md).
"""

from __future__ import annotations

from baton.plugins.moved import retired

__getattr__ = retired(
    __name__,
    {
        "InputProcessor": (
            "InputProcessor",
            "use LLM's / AsyncLLM's tokenize, render_chat, tokenize_rendered_chat, "
            "check_messages, chat_template_variables and get_tokenizer",
        )
    },
    home="baton.frontend.prompts",
)
