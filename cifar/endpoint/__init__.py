"""The model endpoint: the registry's champion over HTTP, followed without a restart.

    settings   ServeSettings: the model it follows, the limits on what a request may hold, the batching knobs
    versions   a registered version fetched, loaded and verified against its export's probe
    follower   watches the alias; loads, verifies and switches to a new champion atomically
    batcher    concurrent requests gathered into one model call; a bounded queue that answers 503 when full
    requests   photos (raw or multipart), today's JSON tensor contract: one clear 400 per problem
    app        the Starlette application: /predict, /invocations, /health/live, /health/ready, /version, the page

Plain Python, Starlette and TensorFlow: no Prefect. `flows/serve.py` is the command that runs it (README
"Serving").
"""
