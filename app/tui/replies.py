"""Sending, streaming, stopping, regenerating and editing replies (a mixin of ChatApp).

A reply runs in a thread worker (`ReplyRun.run`), which posts ReplyStarted, ReplyDelta and
ReplyFinished / ReplyFailed Messages; the `on_reply_...` handlers below take them on the UI thread.
Every handler checks that its run is still the current one, so a reply abandoned by "new chat" or
"open conversation" cannot write into the next conversation.
A message sent while the model loads waits in its conversation and is answered once an engine is ready.
`/image PATH` in the input attaches an image to the next message (the engine reads it when the reply starts).
"""

from __future__ import annotations

from functools import partial
from pathlib import Path

from mlxpaged_app.tui.errors import error_text
from mlxpaged_app.tui.generation import ReplyRun
from mlxpaged_app.tui.messages import ReplyDelta, ReplyFailed, ReplyFinished, ReplyStarted, post_from_thread
from mlxpaged_app.tui.store import Conversation
from mlxpaged_app.tui.widgets.chat_input import ChatInput
from mlxpaged_app.tui.widgets.chat_view import AssistantMessage, UserMessage

from textual import work
from textual.worker import Worker, WorkerState

ATTACH_COMMAND = "/image"


class ReplyFlow:
    def init_replies(self) -> None:
        self.reply: ReplyRun | None = None
        self.reply_view: AssistantMessage | None = None
        self.waiting_in: Conversation | None = None  # whose last message waits for the model to load
        self.attached: list[str] = []  # images (absolute paths) that go with the next message

    @property
    def waiting_question(self) -> bool:
        """A message sent while the model loads, in the conversation on screen, not yet answered."""
        c = self.waiting_in
        return c is not None and c is self.conversation and bool(c.messages) and c.messages[-1]["role"] == "user"

    @property
    def reply_running(self) -> bool:
        return self.reply is not None

    @property
    def current_request_id(self) -> str | None:
        return self.reply.request_id if self.reply is not None else None

    def busy(self, doing: str) -> bool:
        """True (and say so) when `doing` must wait for the engine or the running reply."""
        if self.reply is not None:
            self.notify(f"A reply is being generated: press Esc to stop it before {doing}.", severity="warning")
            return True
        if self.loading_model:
            self.notify(f"The model is still loading: try {doing} again once it is ready.", severity="warning")
            return True
        if self.engine is None:
            self.notify("No model is loaded yet (F4 picks one).", severity="warning")
            return True
        return False

    # --- starting ----------------------------------------------------------------------------
    async def on_chat_input_submitted(self, message: ChatInput.Submitted) -> None:
        text = message.text.strip()
        if not text:
            return
        if text.split(maxsplit=1)[0] == ATTACH_COMMAND:
            self._attach(text[len(ATTACH_COMMAND) :].strip())
            return
        if self.loading_model:
            await self._hold_until_loaded(text)
            return
        if self.busy("sending another message"):
            return
        self.chat_input.clear()
        await self._add_user_message(text)
        await self.start_reply()

    def _attach(self, path: str) -> None:
        """`/image PATH`: the image goes with the next message. Checked as a file here; decoded, checked as an
        image and refused by a text model when the reply starts (the message then comes back to the input)."""
        if not path:
            self.notify(f"Say which image: {ATTACH_COMMAND} PATH (a file on this machine).", severity="warning")
            return
        file = Path(path.strip("'\"")).expanduser()
        if not file.is_file():
            self.notify(f"No image file at {file}.", severity="error")
            return
        self.attached.append(str(file.resolve()))
        self.chat_input.clear()
        if not self.reply_running:
            self.update_status()

    async def _add_user_message(self, text: str) -> None:
        """The message, with the images attached so far, into the conversation and the transcript."""
        images, self.attached = self.attached, []
        self.conversation.add("user", text, **({"images": images} if images else {}))
        await self.chat_log.add(UserMessage(text, images))

    async def _hold_until_loaded(self, text: str) -> None:
        """Show and save the message now; answer_waiting_question sends it when an engine is ready."""
        if self.waiting_question:  # one at a time, as when a reply runs: this text stays in the box
            self.notify("Your last message waits for the model; send this one once it is answered.", severity="warning")
            return
        self.chat_input.clear()
        await self._add_user_message(text)
        self.waiting_in = self.conversation
        self.save_conversation()
        self.update_status()

    async def answer_waiting_question(self) -> None:
        """Called once an engine is ready (loaded, or kept after a failed switch)."""
        waiting, self.waiting_in = self.waiting_question, None
        if waiting and self.reply is None:
            await self.start_reply()

    async def start_reply(self) -> None:
        view = AssistantMessage(self.model_label)
        await self.chat_log.add(view)
        view.start()
        params = self.settings.sampling_params(self.model_defaults)
        run = ReplyRun(self.engine, self.conversation.chat_messages(), params, partial(post_from_thread, self))
        self.reply, self.reply_view = run, view
        self.update_status("Generating… Esc stops.")
        self._run_reply(run)

    @work(thread=True, group="reply", exit_on_error=False)
    def _run_reply(self, run: ReplyRun) -> None:
        run.run()

    # --- messages from the worker (UI thread) --------------------------------------------------
    def on_reply_started(self, message: ReplyStarted) -> None:
        if message.run is self.reply:
            self.refresh_engine_panel()

    async def on_reply_delta(self, message: ReplyDelta) -> None:
        if message.run is self.reply:
            await self.reply_view.append(message.text)

    async def on_reply_finished(self, message: ReplyFinished) -> None:
        run, stats = message.run, message.stats
        if run is not self.reply:
            return
        view, self.reply, self.reply_view = self.reply_view, None, None
        if stats.finish_reason == "abort" and not run.text.strip():
            await view.remove()
            self.notify("Stopped before the first token.")
        else:
            await view.finish(stats)
            self.conversation.model = self.model_label
            self.conversation.add(
                "assistant",
                run.text,
                stats=stats.to_dict(),
                model=self.model_label,
                stopped=stats.finish_reason == "abort",
            )
        self.save_conversation()
        self.update_status()
        self.refresh_engine_panel()

    async def on_reply_failed(self, message: ReplyFailed) -> None:
        if message.run is not self.reply:
            return
        view, self.reply, self.reply_view = self.reply_view, None, None
        await view.remove()
        text = error_text(message.error)
        if message.rejected and self.conversation.messages and self.conversation.messages[-1]["role"] == "user":
            await self._return_last_message_to_input()
            text += "\nYour message is back in the input: edit it, or start a new chat (Ctrl+N)."
        else:
            text += "\nCtrl+R tries again."
        self.notify(text, title="The reply failed", severity="error", timeout=12)
        self.update_status()

    def on_worker_state_changed(self, event: Worker.StateChanged) -> None:
        """A bug in a worker becomes a notification, never a traceback that ends the app."""
        if event.state == WorkerState.ERROR and event.worker.group == "reply":
            self.notify(error_text(event.worker.error), title="The reply failed", severity="error")
            self.reply, self.reply_view = None, None
            self.update_status()

    # --- stopping, regenerating, editing ----------------------------------------------------
    def action_stop(self) -> None:
        if self.reply is not None and not self.reply.stopping:
            self.reply.stop()
            self.update_status("Stopping…")

    def abandon_reply(self) -> None:
        """Stop the running reply and keep what it said so far (before leaving this conversation)."""
        run, self.reply, self.reply_view = self.reply, None, None
        self.waiting_in = None
        if run is None:
            return
        run.stop()
        if run.text.strip():
            self.conversation.add("assistant", run.text, model=self.model_label, stopped=True)
        self.save_conversation()

    async def action_regenerate(self) -> None:
        if self.busy("regenerating"):
            return
        messages = self.conversation.messages
        if not messages:
            self.notify("Nothing to regenerate yet.")
            return
        if messages[-1]["role"] == "assistant":
            messages.pop()
            await self.chat_log.remove_from(len(messages))
        await self.start_reply()

    async def action_edit_last(self) -> None:
        if self.reply is not None:
            self.notify("Press Esc to stop the reply first.", severity="warning")
            return
        if self.conversation.last_index("user") is None:
            self.notify("No message to edit yet.")
            return
        await self._return_last_message_to_input()
        self.save_conversation()

    async def _return_last_message_to_input(self) -> None:
        """Drop the last user message (and what followed it) and put its text in the input, above
        whatever is being typed there."""
        index = self.conversation.last_index("user")
        text = self.conversation.messages[index]["content"]
        self.attached = [*self.conversation.messages[index].get("images", []), *self.attached]  # attached again
        del self.conversation.messages[index:]
        await self.chat_log.remove_from(index)
        draft = self.chat_input.text.strip()
        self.chat_input.text = f"{text}\n{draft}" if draft else text
        self.chat_input.move_cursor(self.chat_input.document.end)
        self.chat_input.focus()
