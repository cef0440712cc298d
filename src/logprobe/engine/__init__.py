"""The engine: requests -> schedule -> pack -> forward -> score -> collect."""
