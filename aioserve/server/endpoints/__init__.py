"""The endpoints: the app, the route table and every handler."""
