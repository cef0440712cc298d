"""Chat conversations: the final assistant message of an OpenAI-style ``messages`` list scored
under the model's own chat template (``Scorer.score_chat``).

The template renders the conversation twice, through ``tokenizer.apply_chat_template`` (its own
tokenization: special tokens come from the template text only, so a template that writes
``{{ bos_token }}`` gives one BOS, never two):

    context = template(messages[:-1], add_generation_prompt=True)   ... <|im_start|>assistant\\n
    full    = template(messages)                                   ... <|im_start|>assistant\\nHi!<|im_end|>\\n

``context`` must be a prefix of ``full``; the scored tokens are the rest: the assistant message
as the template writes it, its end-of-turn marker and whatever the template puts after it. One
request, scored from the first of them on (the last context row predicts the first):

    ids : c0 ... cn | a0 a1 ...        row cn -> a0, row a0 -> a1, ...

A model with a vision tower (Qwen3.5) takes image parts in the messages before the last
(``chat_inputs``): ``{"type": "image", "image": <PIL image | path | bytes | data: URL>}`` or
``{"type": "image_url", "image_url": {"url": "data:image/...;base64,..."}}``. Such a message
reaches the template as a list of parts (``{"type": "image"}`` and text parts), which the
template renders as its image placeholder; each placeholder id is then expanded to its image's
tokens (``scoring.images``). Elsewhere (a text-only model, ``chat_ids``) they are refused by name.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

from ..engine.request import ImageInputs, ScoreRequest
from ..errors import LogprobeError
from ..tokenizer import Tokenizer
from .continuations import continuation_score
from .inputs import check_length
from .options import HeadOptions
from .work import Job, ScoringContext

# OpenAI's message roles: a template that writes a message's role into the text takes these
STANDARD_ROLES = ("system", "user", "assistant", "tool", "developer")
_OUTPUT = re.compile(r"\{\{.*?\}\}", re.S)  # a template's {{ ... }} blocks
_COMPARED = re.compile(r"""role['"]?\]?\s*(?:==|!=)\s*['"]([A-Za-z_][\w-]*)['"]|"""
                       r"""['"]([A-Za-z_][\w-]*)['"]\s*(?:==|!=)\s*[\w.\[\]'"]*\brole\b""")
_LISTED = re.compile(r"""\brole['"]?\]?\s+(?:not\s+)?in\s+[\[(]([^\])]*)[\])]""")


def template_roles(template: str | dict) -> tuple[str, ...]:
    """The message roles a chat template takes: the standard ones (``STANDARD_ROLES``) when it
    writes a message's role into the text (ChatML's ``'<|im_start|>' + message['role']``), else
    user and assistant and those it names; and any role it compares a message's role with (Llama
    3.1's ``message.role == "ipython"``). A role outside them would be rendered as text the model
    never saw in that place (``"wizard"``: ``<|im_start|>wizard``), or refused by the template's
    own ``raise_exception`` with a message about something else.

    >>> chatml = "{% for m in messages %}{{'<|im_start|>' + m['role'] + '\\n' + m['content'] }}{% endfor %}"
    >>> template_roles(chatml)
    ('system', 'user', 'assistant', 'tool', 'developer')
    >>> template_roles("{% for m in messages %}{% if m['role'] == 'user' %}{{ '[INST] ' + m['content'] }}"
    ...                "{% elif m['role'] == 'assistant' %}{{ m['content'] }}{% else %}"
    ...                "{{ raise_exception('Only user and assistant roles') }}{% endif %}{% endfor %}")
    ('user', 'assistant')
    >>> template_roles(chatml + "{% if m.role == 'ipython' %}{% endif %}")[-1]
    'ipython'
    """
    text = "\n".join(template.values()) if isinstance(template, dict) else str(template)
    named = {a or b for a, b in _COMPARED.findall(text)}
    for listed in _LISTED.findall(text):
        named |= set(re.findall(r"""['"]([A-Za-z_][\w-]*)['"]""", listed))
    named |= {r for r in STANDARD_ROLES if re.search(rf"""['"]{r}['"]""", text)}
    writes_role = any(re.search(r"\brole\b", block) and "raise_exception" not in block
                      for block in _OUTPUT.findall(text))
    base = set(STANDARD_ROLES) if writes_role else {"user", "assistant"}
    roles = base | named
    return tuple(r for r in STANDARD_ROLES if r in roles) + tuple(sorted(roles - set(STANDARD_ROLES)))


MEDIA_PARTS = ("image_url", "image", "input_image", "audio", "input_audio", "audio_url", "video", "video_url",
               "file", "input_file")


def content_text(content, field: str = "content") -> str:
    r"""A message's content as the text the chat template renders: a string as it is, a list of
    OpenAI content parts as its text parts joined by newlines (how vLLM renders parts for a
    template that takes strings). Image, audio, video and file parts are refused by name: the
    text would be scored without them, as if they had not been sent.

        >>> content_text([{"type": "text", "text": "Describe"}, {"type": "text", "text": "briefly."}])
        'Describe\nbriefly.'
        >>> content_text([{"type": "image_url", "image_url": {"url": "data:..."}}], "messages[0].content")
        Traceback (most recent call last):
        ...
        logprobe.errors.LogprobeError: messages[0].content[0]: is an image_url part: logprobe scores text given text; images, audio and files in prompts are not taken yet; send the text parts only
    """
    if isinstance(content, str):
        return content
    return "\n".join(_text_part(part, f"{field}[{j}]") for j, part in enumerate(content))


def _text_part(part, field: str) -> str:
    """A text part's text; a media part is refused by name (a model without a vision tower, or
    audio, video and files)."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind in MEDIA_PARTS:
        raise LogprobeError(field, f"is an {kind} part: logprobe scores text given text; images, audio "
                            "and files in prompts are not taken yet", "send the text parts only")
    if kind != "text" or not isinstance(part.get("text"), str):
        raise LogprobeError(field, 'must be a text part {"type": "text", "text": "..."}')
    return part["text"]


def image_source(part: dict, field: str):
    """The image of an ``image`` part (``part["image"]``) or an ``image_url`` part (a ``data:`` URL,
    as a string or ``{"url": ...}``): what ``scoring.images.read_image`` reads."""
    if part.get("type") == "image":
        if part.get("image") is None:
            raise LogprobeError(f"{field}.image", "is missing: an image part carries its image",
                                '{"type": "image", "image": <PIL image, bytes, a path or a data: URL>}')
        return part["image"]
    url = part.get("image_url")
    url = url.get("url") if isinstance(url, dict) else url
    if not isinstance(url, str) or not url.startswith("data:"):
        raise LogprobeError(f"{field}.image_url", "must be a data: URL (images are not fetched)",
                            'send {"url": "data:image/png;base64,..."}')
    return url


def content_parts(content, field: str, images: list) -> str | list[dict]:
    """``content_text``, except that a list with image parts becomes the template's parts:
    ``{"type": "image"}`` for each (its source appended to ``images`` with its field), text parts
    as they are."""
    if isinstance(content, str) or not any(isinstance(p, dict) and p.get("type") in ("image", "image_url")
                                           for p in content):
        return content_text(content, field)
    parts = []
    for j, part in enumerate(content):
        if isinstance(part, dict) and part.get("type") in ("image", "image_url"):
            images.append((image_source(part, f"{field}[{j}]"), f"{field}[{j}]"))
            parts.append({"type": "image"})
        else:
            parts.append({"type": "text", "text": _text_part(part, f"{field}[{j}]")})
    return parts


def check_messages(messages, field: str = "messages", roles: Sequence[str] | None = None,
                   images: list | None = None) -> list[dict]:
    """``messages`` as a list of ``{"role", "content"}`` dicts (strings), the last one the
    assistant's, with at least one message before it; each role one of ``roles`` (the chat
    template's, ``template_roles``) when given. ``images``: a list that collects the image parts'
    sources and fields (``content_parts``: those messages keep a list of parts); None: they are
    refused."""
    if isinstance(messages, (str, bytes, dict)) or not isinstance(messages, Sequence) or len(messages) < 2:
        raise LogprobeError(field, "must be a list of at least two {role, content} messages, the last one the "
                            "assistant's", 'e.g. [{"role": "user", "content": "Hi"}, {"role": "assistant", '
                            '"content": "Hello!"}]')
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) \
                or not isinstance(m.get("content"), (str, list, tuple)):
            raise LogprobeError(f"{field}[{i}]", "must be an object with a string role and a content (a string, or "
                                "a list of text parts)")
        if roles is not None and m["role"] not in roles:
            raise LogprobeError(f"{field}[{i}].role", f"{m['role']!r} is not a role the model's chat template takes",
                                f"use one of: {', '.join(roles)}")
        where = f"{field}[{i}].content"
        content = content_text(m["content"], where) if images is None else content_parts(m["content"], where, images)
        out.append({"role": m["role"], "content": content})
    if out[-1]["role"] != "assistant":
        raise LogprobeError(f"{field}[{len(out) - 1}].role", f"is {out[-1]['role']!r}: the scored message is the "
                            "last one and must be the assistant's", "end the conversation with the assistant message")
    return out


def _template_ids(tokenizer: Tokenizer, messages: list[dict], generation_prompt: bool, field: str) -> list[int]:
    hf = tokenizer.hf
    try:
        ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=generation_prompt)
    except Exception as e:  # the template's own error (jinja: "conversation roles must alternate", ...)
        raise LogprobeError(field, f"the chat template refused the conversation ({e})") from e
    if hasattr(ids, "keys"):  # transformers 5: a BatchEncoding
        ids = ids["input_ids"]
    return [int(i) for i in ids]


def chat_ids(context: ScoringContext, messages, field: str = "messages") -> tuple[list[int], list[int]]:
    """``(context ids, scored ids)`` of a conversation under the model's chat template (see the
    module docstring). Raises for a tokenizer without a chat template; image parts are refused."""
    tokenizer = context.tokenizer
    if not getattr(tokenizer.hf, "chat_template", None):
        raise LogprobeError(field, f"{context.name} has no chat template (its tokenizer defines none)",
                            "score the rendered text with score(prompt, continuation), or load an instruct model")
    return _rendered(context, check_messages(messages, field, template_roles(tokenizer.hf.chat_template)), field)


def chat_inputs(context: ScoringContext, messages, field: str = "messages"
                ) -> tuple[list[int], list[int], ImageInputs | None]:
    """``chat_ids`` and the request's images: a model with a vision tower takes image parts in
    the messages before the last (see the module docstring)."""
    if context.images is None:
        return (*chat_ids(context, messages, field), None)
    tokenizer = context.tokenizer
    if not getattr(tokenizer.hf, "chat_template", None):
        return (*chat_ids(context, messages, field), None)  # its refusal
    images: list = []
    checked = check_messages(messages, field, template_roles(tokenizer.hf.chat_template), images)
    last = f"{field}[{len(checked) - 1}]."
    for _, where in images:
        if where.startswith(last):
            raise LogprobeError(where, "is an image in the scored message: only text is scored (an image token "
                                "carries no log-prob)", "put the images in the messages before the last")
    prompt, scored = _rendered(context, checked, field)
    if not images:
        return prompt, scored, None
    reader = context.images
    pixels, grids = reader.patches([src for src, _ in images], field, [where for _, where in images])
    if reader.fmt.around:  # text around each image (Gemma 3's "\n\n") tokenizes with its neighbours
        prompt = _expanded_text_ids(context, checked[:-1], prompt, grids, field)
    else:
        prompt = reader.expand(prompt, grids, field)
    return prompt, scored, reader.inputs(prompt + scored, pixels, grids, field)


def _expanded_text_ids(context: ScoringContext, messages: list[dict], ids: list[int], grids: list, field: str
                       ) -> list[int]:
    """The prompt's ids with each image expanded in its text, then tokenized as one text, as the
    family's processor does (``"user\n" + "\n\n<start_of_image>"`` may become one newline token
    and the image run, not "\n" and "\n\n"); where the template's ids are not its text's tokens, the
    ids expanded one by one (``ImageReader.expand``)."""
    reader, tokenizer = context.images, context.tokenizer
    try:
        text = tokenizer.hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    except Exception:  # rendered as ids above: the same template; keep its ids
        return reader.expand(ids, grids, field)
    pieces = text.split(reader.placeholder) if isinstance(text, str) else []
    if len(pieces) != len(grids) + 1 or tokenizer.encode(text) != ids:
        return reader.expand(ids, grids, field)
    return tokenizer.encode(pieces[0] + "".join(reader.expansion_text(g) + rest for g, rest in zip(grids, pieces[1:])))


def _rendered(context: ScoringContext, messages: list[dict], field: str) -> tuple[list[int], list[int]]:
    tokenizer = context.tokenizer
    prompt = _template_ids(tokenizer, messages[:-1], True, field)
    full = _template_ids(tokenizer, messages, False, field)
    if full[:len(prompt)] != prompt or len(full) == len(prompt):
        raise LogprobeError(field, "the chat template does not render the conversation as the conversation "
                            "before the last message plus the generation prompt, then the assistant message",
                            "score the rendered text with score(prompt, continuation)")
    context.check_ids(full, field)
    return prompt, full[len(prompt):]


def chat_job(context: ScoringContext, messages, head: HeadOptions = HeadOptions(),
             field: str = "messages") -> Job:
    """``Scorer.score_chat_job``: one request; the answer is a ``ContinuationScore`` whose
    ``continuation`` is the scored tokens' text (the assistant message as the template writes it)."""
    head = head.checked()
    prompt, scored, images = chat_inputs(context, messages, field)
    check_length(len(prompt) + len(scored), field, context.max_length)
    req = ScoreRequest(prompt + scored, len(prompt), head.temperature, head.top_k, head.entropy, images=images)
    text = context.tokenizer.decode(scored)
    return Job([req], lambda results: continuation_score(context.tokenizer, text, req, results[0]))
