"""The API's routers, one per endpoint family; `serve/app.py` includes them."""
