"""Conversations and where they are kept: one JSON file each under the user's data directory."""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

DATA_DIR_ENV = "MLXPAGED_DATA_DIR"
TITLE_CHARS = 60


@dataclass
class Conversation:
    """A chat: the system prompt and the turns. Messages are {"role", "content"} dicts; user messages may carry
    "images" (the paths of the images attached to them), assistant messages "stats" (a ReplyStats dict) and
    "stopped"."""

    id: str
    model: str | None = None
    system_prompt: str = ""
    messages: list[dict] = field(default_factory=list)
    created: float = field(default_factory=time.time)
    updated: float = field(default_factory=time.time)

    @classmethod
    def new(cls, model: str | None = None, system_prompt: str = "") -> Conversation:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        return cls(f"{stamp}-{secrets.token_hex(3)}", model, system_prompt)

    @property
    def title(self) -> str:
        first = next((m["content"] for m in self.messages if m["role"] == "user"), "")
        line = " ".join(first.split())
        return (line[: TITLE_CHARS - 1] + "…" if len(line) > TITLE_CHARS else line) or "(empty)"

    @property
    def turns(self) -> int:
        return sum(1 for m in self.messages if m["role"] == "user")

    def chat_messages(self) -> list[dict]:
        """What the model sees: the system prompt (if any) and every turn, without our extras."""
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt.strip() else []
        return system + [{"role": m["role"], "content": _content(m)} for m in self.messages]

    def add(self, role: str, content: str, **extra) -> dict:
        message = {"role": role, "content": content, **extra}
        self.messages.append(message)
        return message

    @property
    def has_images(self) -> bool:
        return any(m.get("images") for m in self.messages)

    def last_index(self, role: str) -> int | None:
        for i in range(len(self.messages) - 1, -1, -1):
            if self.messages[i]["role"] == role:
                return i
        return None

    def to_json(self) -> str:
        return json.dumps(asdict(self), ensure_ascii=False, indent=1)

    @classmethod
    def from_json(cls, text: str) -> Conversation:
        data = json.loads(text)
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def _content(message: dict) -> str | list[dict]:
    """A message's content as the engine takes it: its images (Engine.chat's image parts, by path) before its text."""
    images = message.get("images")
    if not images:
        return message["content"]
    return [*({"type": "image", "image": path} for path in images), {"type": "text", "text": message["content"]}]


class ConversationStore:
    def __init__(self, root: Path):
        self.root = Path(root)

    @classmethod
    def default(cls) -> ConversationStore:
        """$MLXPAGED_DATA_DIR/conversations, else the platform's user data directory."""
        override = os.environ.get(DATA_DIR_ENV)
        if override:
            return cls(Path(override).expanduser() / "conversations")
        from platformdirs import user_data_path

        return cls(user_data_path("mlxpaged", appauthor=False) / "conversations")

    def path(self, conversation_id: str) -> Path:
        return self.root / f"{conversation_id}.json"

    def save(self, conversation: Conversation) -> Path:
        """Write atomically (a crash mid-write leaves the previous version)."""
        conversation.updated = time.time()
        self.root.mkdir(parents=True, exist_ok=True)
        target = self.path(conversation.id)
        partial = target.with_suffix(".json.partial")
        partial.write_text(conversation.to_json(), encoding="utf-8")
        partial.replace(target)
        return target

    def load(self, conversation_id: str) -> Conversation:
        return Conversation.from_json(self.path(conversation_id).read_text(encoding="utf-8"))

    def list(self) -> list[Conversation]:
        """Saved conversations, most recently updated first; unreadable files are skipped."""
        found = []
        for path in self.root.glob("*.json") if self.root.exists() else []:
            try:
                found.append(Conversation.from_json(path.read_text(encoding="utf-8")))
            except (OSError, ValueError, TypeError):
                continue
        return sorted(found, key=lambda c: c.updated, reverse=True)

    def latest(self) -> Conversation | None:
        conversations = self.list()
        return conversations[0] if conversations else None
