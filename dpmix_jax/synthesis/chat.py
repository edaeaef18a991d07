"""Chat formatting of the teachers' prompts for an instruct model.

An instruct model (SmolLM2-135M-Instruct, Llama 3.x Instruct, Qwen2.5 Instruct, ...) ships a
Jinja chat template: in a GGUF file as the metadata key ``tokenizer.chat_template``, in a
transformers folder as ``chat_template.jinja`` or the ``chat_template`` of
``tokenizer_config.json``. `ChatTemplate` renders it with `jinja2` as transformers'
``apply_chat_template`` does (a sandboxed environment with ``trim_blocks`` and ``lstrip_blocks``,
``raise_exception`` and ``tojson``), and `ChatTemplate.layout` cuts the rendered conversation
around the documents.

The layout of teacher i's prompt, followed by every sample's tokens, is one user turn and the
opening of the assistant's turn::

    render([{"role": "user",
             "content": intro + "\\n" + d_1 + separator + ... + d_k + separator + "\\n" + request}],
           add_generation_prompt=True) + prompt

where d_1 ... d_k are the teacher's documents (as many as fit its public width), `intro` and
`request` are `CHAT_INTRO` and `CHAT_REQUEST`, and `prompt` is the public text the assistant's
reply starts with. For SmolLM2 that is::

    <|im_start|>system
    You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
    <|im_start|>user
    Here are some texts, one per line:
    {d_1}
    ...
    {d_k}

    Write one more text like these, on one line. Reply with the text only.<|im_end|>
    <|im_start|>assistant
    {prompt}

`ChatLayout.head` is the text before d_1, `ChatLayout.tail` the text after the last separator
(before `prompt`): both public, so the teachers differ only in their documents, and the public
fallback reads head + tail, the same turn with no documents. The model continues as the
assistant; its turn ends at the model's end-of-turn token (its EOS) or, with `stop_at_newline`,
at the end of the line.

Privacy:
    Templates, intro and request are public; a teacher's rendered prompt is as sensitive as its
    documents.
"""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
from collections.abc import Mapping, Sequence

__all__ = ["CHAT_INTRO", "CHAT_REQUEST", "ChatLayout", "ChatTemplate", "read_chat_template"]

CHAT_INTRO = "Here are some texts, one per line:"
CHAT_REQUEST = "Write one more text like these, on one line. Reply with the text only."
# A public stand-in for the documents while the template is rendered and cut.
_DOCUMENTS_MARK = "\x00documents\x00"
_PROBE = "A public line.\nAnother one.\n"


@dataclasses.dataclass(frozen=True)
class ChatLayout:
    """A user turn cut around its documents (see the module docstring).

    Attributes:
        head: the rendered text before the first document (system turn, user turn opening,
            intro and its newline).
        tail: the rendered text after the documents' last separator (the blank line, the
            request, the end of the user turn and the opening of the assistant's turn).
    """

    head: str
    tail: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class ChatTemplate:
    """A model's chat template and the special tokens it may name.

    Attributes:
        template: the Jinja source.
        bos_token, eos_token: passed to the template as transformers does ("" when the model
            has none).
        source: where the template came from, for error messages.
    """

    template: str
    bos_token: str = ""
    eos_token: str = ""
    source: str = "the model"

    def render(
        self, messages: Sequence[Mapping[str, str]], *, add_generation_prompt: bool = True
    ) -> str:
        """The conversation `messages` rendered as text, ending with the assistant's opening
        when `add_generation_prompt` (transformers' ``apply_chat_template(..., tokenize=False)``).

        Raises:
            ValueError: one line naming the source when the template does not render.

        Privacy:
            The text is as sensitive as the messages; the ensembles render public text only
            (`layout`) and place the documents between its pieces.
        """
        import jinja2
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise jinja2.TemplateError(message)

        def tojson(value, indent=None):
            return json.dumps(value, ensure_ascii=False, indent=indent)

        environment = ImmutableSandboxedEnvironment(
            trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
        )
        environment.filters["tojson"] = tojson
        environment.globals["raise_exception"] = raise_exception
        try:
            return environment.from_string(self.template).render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except jinja2.TemplateError as err:
            message = " ".join(str(err).split())
            raise ValueError(
                f"the chat template of {self.source} does not render: {message}"
            ) from None

    def user_turn(self, content: str) -> str:
        """One user turn holding `content`, then the assistant's opening."""
        return self.render([{"role": "user", "content": content}])

    def layout(self, *, intro: str = CHAT_INTRO, request: str = CHAT_REQUEST) -> ChatLayout:
        """The head and tail around the documents of a user turn (module docstring).

        Raises:
            ValueError: one line when the template does not hold a user message verbatim (for
                instance it trims it), so that documents cannot be placed between a fixed head
                and tail.
        """
        rendered = self.user_turn(f"{intro}\n{_DOCUMENTS_MARK}\n{request}")
        if rendered.count(_DOCUMENTS_MARK) != 1:
            raise ValueError(
                f"the chat template of {self.source} does not hold a user message verbatim"
            )
        head, tail = rendered.split(_DOCUMENTS_MARK)
        if self.user_turn(f"{intro}\n{_PROBE}\n{request}") != head + _PROBE + tail:
            raise ValueError(
                f"the chat template of {self.source} changes the text of a user message (it "
                "must hold it verbatim for the documents to sit between a public head and tail)"
            )
        return ChatLayout(head=head, tail=tail)


def read_chat_template(path: str | os.PathLike) -> ChatTemplate | None:
    """The chat template of a GGUF file or a transformers (or dpmix) folder; None without one.

    A GGUF file's is its ``tokenizer.chat_template`` metadata, with the BOS and EOS tokens
    its ``tokenizer.ggml.*_token_id`` name. A folder's is ``chat_template.jinja``, else the
    ``chat_template`` of ``tokenizer_config.json`` (a string, or a list of named templates of
    which "default" is taken), with that file's ``bos_token`` and ``eos_token``.

    Raises:
        ValueError: one line naming the file when a template is present but unreadable.
    """
    path = pathlib.Path(path)
    if path.is_file():
        return _gguf_chat_template(path)
    config_file = path / "tokenizer_config.json"
    config = {}
    if config_file.is_file():
        try:
            config = json.loads(config_file.read_text())
        except json.JSONDecodeError as err:
            raise ValueError(f"{config_file} is not valid JSON ({err})") from None
    config = config if isinstance(config, dict) else {}
    template = config.get("chat_template")
    if (path / "chat_template.jinja").is_file():
        template = (path / "chat_template.jinja").read_text()
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    if template is None:
        return None
    if not isinstance(template, str):
        raise ValueError(f"{config_file}: chat_template is not a string")
    return ChatTemplate(
        template=template,
        bos_token=_token_text(config.get("bos_token")),
        eos_token=_token_text(config.get("eos_token")),
        source=str(path),
    )


def _token_text(token) -> str:
    """A special token as tokenizer_config.json gives it (a string or an AddedToken dict)."""
    if isinstance(token, Mapping):
        token = token.get("content")
    return token if isinstance(token, str) else ""


def _gguf_chat_template(path: pathlib.Path) -> ChatTemplate | None:
    from gguf import GGUFReader

    try:
        fields = GGUFReader(path).fields
    except (ValueError, OSError, IndexError, KeyError, TypeError) as err:
        raise ValueError(f"{path} is not a readable GGUF file: {err}") from None
    if "tokenizer.chat_template" not in fields:
        return None
    tokens = fields["tokenizer.ggml.tokens"].contents() if "tokenizer.ggml.tokens" in fields else []

    def special(name: str) -> str:
        field = fields.get(f"tokenizer.ggml.{name}_token_id")
        index = None if field is None else int(field.contents())
        return tokens[index] if index is not None and 0 <= index < len(tokens) else ""

    return ChatTemplate(
        template=str(fields["tokenizer.chat_template"].contents()),
        bos_token=special("bos"),
        eos_token=special("eos"),
        source=str(path),
    )
