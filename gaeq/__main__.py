from gaeq.cli import app

app()
