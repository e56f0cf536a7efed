"""`nnrun serve`: one engine shared by many notebooks, scripts and OpenAI clients.

Server side, one job per file:
  config         ServeConfig: host, key, limits (refuses a non-loopback host without a key)
  command        the `nnrun serve MODEL ...` subcommand: load the model, run uvicorn
  drain          SIGTERM: drain, cut what is left with a clear error, exit 0, never hang
  http_limits    header size and time, open connections: bounded before any route runs
  app            the FastAPI app: its routes, lifespan and middleware
  state          what every route shares (ServeState): config, model, worker threads, the drain
  limits         API key (401), body size (413) and time (408), requests in flight (429)
  engine_model   ServedLanguageModel: nnrun's LanguageModel with deadlines, cancellation, edits
  block_watch    how long a block holds the engine; EditWatchdog ends edits that hold it on completions
  payload        a serialized nnsight trace rebuilt over the server's own tree
  trace_route    /v1/nnsight/generate, /v1/nnsight/register/{id}, /v1/nnsight/clear
  registration   registered edits: a block run for every request
  openai_routes  /v1/models, /v1/completions, /v1/chat/completions (SSE streaming), several choices each
  openai_protocol  the OpenAI request bodies: each field served or refused by name; n samples' seeds
  openai_answer  an answer's choices (prompt by sample), their logprobs and echo, the usage
  openai_logprobs  log-probabilities in OpenAI's completion and chat shapes
  openai_errors  refusals in OpenAI's shape {"error": {message, type, param, code}} on the OpenAI routes
  wire           the bytes both sides exchange: headers, results, deferred errors
Client side:
  client         RemoteLanguageModel (`nnrun.LanguageModel(name, serve=url)`), its tracer and backend
  transport      the client's HTTP: keep-alive POSTs, 429/503 retried, failures as ConnectionError

nnrun's engine modules never import this package; it imports nnsight and FastAPI.
"""
