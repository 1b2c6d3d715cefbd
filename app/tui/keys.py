"""Every key binding of the chat app, in one place: the app binds them, the help screen lists them."""

from __future__ import annotations

from textual.binding import Binding

APP_BINDINGS = [
    Binding("f1", "help", "Help"),
    Binding("escape", "stop", "Stop"),
    Binding("ctrl+n", "new_chat", "New"),
    Binding("ctrl+r", "regenerate", "Regen"),
    Binding("ctrl+l", "edit_last", "Edit"),
    Binding("f2", "toggle_engine", "Engine"),
    Binding("f3", "settings", "Settings"),
    Binding("f4", "pick_model", "Model"),
    Binding("f5", "system_prompt", "System"),
    Binding("ctrl+o", "open_conversation", "Chats"),
    Binding("ctrl+q", "quit", "Quit", priority=True),
]

HELP_SECTIONS = [
    (
        "Chat",
        [
            ("enter", "send the message"),
            ("ctrl+j", "new line in the message (shift+enter too, where the terminal reports it)"),
            ("escape", "stop the reply being generated (its KV blocks are freed at once)"),
            ("ctrl+r", "regenerate the last reply"),
            ("ctrl+l", "edit the last message: it goes back into the input, its reply is dropped"),
            ("ctrl+n", "new chat (the current one is saved)"),
            ("ctrl+o", "open a saved conversation"),
            ("/image PATH", "attach an image to your next message (a vision-language model reads it)"),
        ],
    ),
    (
        "Model and settings",
        [
            ("f2", "show / hide the engine panel (KV blocks, block map, memory)"),
            ("f3", "sampling settings: temperature, top_p, max tokens, seed"),
            ("f4", "switch model (presets and local models)"),
            ("f5", "edit the system prompt"),
        ],
    ),
    (
        "App",
        [
            ("f1", "this help"),
            ("tab / shift+tab", "move the focus"),
            ("ctrl+p", "command palette"),
            ("ctrl+q", "quit"),
        ],
    ),
    (
        "In dialogs",
        [
            ("enter", "confirm / choose"),
            ("escape", "cancel"),
            ("ctrl+s", "save (system prompt editor)"),
        ],
    ),
]

_NAMES = {"escape": "Esc", "enter": "Enter", "tab": "Tab", "ctrl": "Ctrl", "shift": "Shift", "alt": "Alt"}


def key_label(key: str) -> str:
    """ "ctrl+j" -> "Ctrl+J", "escape" -> "Esc", "f1" -> "F1"; a command typed in the input ("/image PATH") as it
    is typed."""
    if key.startswith("/"):
        return key
    return "+".join(_NAMES.get(part, part.upper() if len(part) <= 3 else part.capitalize()) for part in key.split("+"))
