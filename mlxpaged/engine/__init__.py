"""The loop: `Engine` (engine.py: thread, command queue, public API) drives `EngineCore.step()` (core.py:
schedule -> execute -> update -> process); the scheduler, requests, output processing, text streams and counters."""
