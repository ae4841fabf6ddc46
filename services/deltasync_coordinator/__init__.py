"""The deltasync coordinator: a FastAPI service over a SQLite ledger of versions, plans and agents."""

__all__: list[str] = []
