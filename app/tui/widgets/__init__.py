"""The chat app's widgets: chat view, message box, engine panel and block map, loading panel."""
