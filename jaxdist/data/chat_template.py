"""Chat templates: which one (``find_chat_template``), rendering it safely, and which
characters of a rendered conversation are the assistant's (``ChatTemplate.assistant_spans``).

A chat template is a Jinja program that someone hands over (a model's tokenizer_config.json, a
file): it is rendered in Jinja's immutable sandbox, never executed as Python, with the
variables Hugging Face's templates expect (``messages``, ``bos_token``, ``eos_token`` and the
other special tokens, ``add_generation_prompt``, ``raise_exception``) and the same settings
(blocks trimmed, ``loopcontrols``, a ``tojson`` that leaves non-ASCII and HTML characters alone),
so a template renders the text ``transformers``' ``apply_chat_template`` renders. No clock is
offered (``strftime_now``): a template that dates its system prompt takes its fixed default,
so the training text does not change from one day to the next.

The assistant's characters come from ``{% generation %}...{% endgeneration %}`` blocks when
the template has them; otherwise from rendering the conversation prefix by prefix: assistant
message k spans from the end of messages[:k] rendered with the generation prompt to the end
of messages[:k+1]. That needs each prefix's text to be the start of the next one (the
conversation's text only grows); a template that rewrites earlier text (a system prompt moved
next to the last user message, earlier reasoning removed) cannot be masked this way, and is
refused in one line rather than trained on a wrong mask.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from jaxdist.errors import JaxdistError

ROLES = ("system", "user", "assistant", "tool")
TEMPLATE_FILE = "chat_template.jinja"  # beside a tokenizer; transformers prefers it to tokenizer_config.json's
CONFIG_FILE = "tokenizer_config.json"
MAX_TEMPLATE_BYTES = 1 << 20
SPECIAL_TOKENS = ("bos_token", "eos_token", "pad_token", "unk_token")
# Private-use characters that bracket what a {% generation %} block renders (refused in the data).
GENERATION_START, GENERATION_END = "\ue000", "\ue001"


class TemplateRaised(Exception):  # noqa: N818 - the template's own raise_exception(), said to the user as it is
    """``raise_exception(message)`` called by a template."""


def _raise_exception(message):
    raise TemplateRaised(str(message))


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class _GenerationMarks(jinja2.ext.Extension):
    """``{% generation %}BODY{% endgeneration %}`` renders BODY between two marker characters,
    which ``ChatTemplate`` removes, keeping where they were."""

    tags = {"generation"}

    def __init__(self, environment):
        super().__init__(environment)
        self.seen = False  # the environment parsed a generation block

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        self.seen = True
        return nodes.CallBlock(self.call_method("_mark", []), [], [], body).set_lineno(lineno)

    def _mark(self, caller):
        return GENERATION_START + caller() + GENERATION_END


@dataclasses.dataclass(frozen=True)
class ChatTemplate:
    """A template's text, where it came from (for messages) and the special tokens it is given."""

    source: str
    text: str
    special_tokens: tuple[tuple[str, str], ...] = ()

    @functools.cached_property
    def _compiled(self) -> tuple[jinja2.Template, _GenerationMarks]:
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_GenerationMarks, jinja2.ext.loopcontrols])
        env.filters["tojson"] = _tojson
        env.globals["raise_exception"] = _raise_exception
        try:
            template = env.from_string(self.text)
        except jinja2.TemplateSyntaxError as e:
            raise JaxdistError(f"chat template {self.source}: line {e.lineno}: {e.message}") from None
        return template, env.extensions[_GenerationMarks.identifier]

    @property
    def has_generation_blocks(self) -> bool:
        return self._compiled[1].seen

    def render(self, messages: list[dict], add_generation_prompt: bool = False, where: str = "") -> str:
        """The conversation's text (generation markers removed)."""
        return _strip_marks(self._render(messages, add_generation_prompt, where))

    def _render(self, messages: list[dict], add_generation_prompt: bool, where: str) -> str:
        template = self._compiled[0]
        context = {"messages": messages, "add_generation_prompt": add_generation_prompt, **dict(self.special_tokens)}
        at = f" ({where})" if where else ""
        try:
            return template.render(**context)
        except TemplateRaised as e:
            raise JaxdistError(f"chat template {self.source} refused the conversation{at}: {_one_line(str(e))}") from None
        except jinja2.exceptions.SecurityError as e:
            raise JaxdistError(f"chat template {self.source}: the sandbox refused it{at}: {_one_line(str(e))}") from None
        except Exception as e:  # noqa: BLE001 - whatever a template's expression raises is one line
            raise JaxdistError(f"chat template {self.source} failed{at}: {type(e).__name__}: {_one_line(str(e))}") from None

    def assistant_spans(self, messages: list[dict], where: str = "") -> tuple[str, list[tuple[int, int]]]:
        """(the conversation's text, [start, end) character spans of the assistant's text:
        its messages and what the template closes each with, e.g. an end-of-turn token)."""
        for message in messages:
            if any(mark in str(message.get("content") or "") for mark in (GENERATION_START, GENERATION_END)):
                raise JaxdistError(f"a message holds U+E000 or U+E001, which mark the assistant's text{_at(where)}")
        marked = self._render(messages, False, where)
        if self.has_generation_blocks:
            return _marked_spans(marked)
        full, spans = _strip_marks(marked), []
        for k, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            before = self.render(messages[:k], True, where)
            through = self.render(messages[: k + 1], False, where)
            if not (through.startswith(before) and full.startswith(through)):
                raise JaxdistError(
                    f"chat template {self.source} cannot be masked: the text of messages[:{k + 1}] is not where the whole "
                    f"conversation's starts{_at(where)} (it rewrites earlier turns); use a template with "
                    "{% generation %} blocks around the assistant's text, or data.loss_on=all"
                )
            spans.append((len(before), len(through)))
        return full, spans


def _at(where: str) -> str:
    return f" ({where})" if where else ""


def _one_line(text: str) -> str:
    return " ".join(text.split())[:300]


def _strip_marks(text: str) -> str:
    return text.replace(GENERATION_START, "").replace(GENERATION_END, "")


def _marked_spans(marked: str) -> tuple[str, list[tuple[int, int]]]:
    """Remove the generation markers; return the text and the spans they bracketed."""
    pieces, spans, length, position = [], [], 0, 0
    while (start := marked.find(GENERATION_START, position)) >= 0:
        end = marked.find(GENERATION_END, start)
        end = len(marked) if end < 0 else end
        before, inside = marked[position:start], _strip_marks(marked[start + 1 : end])
        length += len(before)
        if inside:
            spans.append((length, length + len(inside)))
        pieces += [before, inside]
        length += len(inside)
        position = end + 1
    pieces.append(_strip_marks(marked[position:]))
    return "".join(pieces), spans


def check_messages(messages) -> str | None:
    """Why ``messages`` is not a conversation (None when it is): a non-empty list of objects
    with a known ``role`` and a string ``content`` (null allowed beside ``tool_calls``)."""
    if not isinstance(messages, list) or not messages:
        return "'messages' is not a non-empty list"
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            return f"messages[{i}] is not an object"
        role = message.get("role")
        if role not in ROLES:
            return f"messages[{i}] has role {role!r}, not one of {', '.join(ROLES)}"
        content = message.get("content")
        if not isinstance(content, str) and not (content is None and message.get("tool_calls")):
            return f"messages[{i}] content is {type(content).__name__}, not a string"
    return None


def find_chat_template(template_file: str, tokenizer: str) -> ChatTemplate:
    """The template of ``data.chat_template`` (a file), else the one beside the tokenizer file
    (``chat_template.jinja``, else ``tokenizer_config.json``'s ``chat_template``, as transformers
    reads them); the special tokens from that tokenizer_config.json (or special_tokens_map.json)."""
    folder = Path(tokenizer).expanduser().parent if tokenizer not in ("", "byte") else None
    special = _special_tokens(folder) if folder is not None else ()
    if template_file:
        path = Path(template_file).expanduser()
        return ChatTemplate(str(path), _read_template(path, "data.chat_template"), special)
    if folder is None:
        raise JaxdistError("no chat template: the tokenizer is byte-level (no tokenizer_config.json); give data.chat_template=FILE")
    beside = _inside(folder, TEMPLATE_FILE)
    if beside is not None:
        return ChatTemplate(str(beside), _read_template(beside, str(folder)), special)
    config_file = _inside(folder, CONFIG_FILE)
    text = _config_template(_read_json(config_file)) if config_file is not None else None
    if text is None:
        raise JaxdistError(
            f"no chat template: {folder} has no {TEMPLATE_FILE} and no chat_template in {CONFIG_FILE}; give data.chat_template=FILE"
        )
    return ChatTemplate(f"{config_file} (chat_template)", text, special)


def _config_template(config: dict) -> str | None:
    """tokenizer_config.json's ``chat_template``: a string, or a list of named ones (the "default")."""
    value = config.get("chat_template")
    if isinstance(value, list):
        value = next((t.get("template") for t in value if isinstance(t, dict) and t.get("name") == "default"), None)
    return value if isinstance(value, str) and value else None


def _special_tokens(folder: Path) -> tuple[tuple[str, str], ...]:
    """bos_token, eos_token, pad_token, unk_token as text ("" when not said)."""
    found: dict[str, str] = {}
    for name in (CONFIG_FILE, "special_tokens_map.json"):
        path = _inside(folder, name)
        config = _read_json(path) if path is not None else {}
        for key in SPECIAL_TOKENS:
            value = config.get(key)
            value = value.get("content") if isinstance(value, dict) else value  # an AddedToken's serialisation
            if key not in found and isinstance(value, str):
                found[key] = value
    return tuple((key, found.get(key, "")) for key in SPECIAL_TOKENS)


def _inside(folder: Path, name: str) -> Path | None:
    """``folder / name`` resolved, or None when absent; one that links out of the folder is refused."""
    path = folder / name
    if not (path.exists() or path.is_symlink()):
        return None
    target = path.resolve()
    if not target.is_relative_to(folder.resolve()):
        raise JaxdistError(f"{folder}: {name} leads outside the folder (to {target}); copy the file in instead of linking to it")
    return target


def _read_template(path: Path, what: str) -> str:
    try:
        data = path.read_bytes()[: MAX_TEMPLATE_BYTES + 1]
    except FileNotFoundError:
        raise JaxdistError(f"{what}: chat template {path}: no such file") from None
    except OSError as e:
        raise JaxdistError(f"{what}: chat template {path}: {e.strerror or e}") from None
    if len(data) > MAX_TEMPLATE_BYTES:
        raise JaxdistError(f"chat template {path}: over {MAX_TEMPLATE_BYTES >> 20} MiB; not a template")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise JaxdistError(f"chat template {path}: not UTF-8 text") from None


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise JaxdistError(f"{path}: unreadable JSON ({_one_line(str(e))})") from None
    return value if isinstance(value, dict) else {}
