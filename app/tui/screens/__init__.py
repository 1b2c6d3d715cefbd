"""The chat app's screens: every Screen and ModalScreen it pushes (help, history, settings, ...)."""
