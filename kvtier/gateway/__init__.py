"""OpenAI-compatible HTTP front end: the model's text side, tools, sessions inferred from the
conversation, and the FastAPI app (DESIGN §3, §6 "Gateway")."""
