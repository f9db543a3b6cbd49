"""The HTTP transport over the serving core (:mod:`ortbatch.serve.served`): the plumbing
every app shares (:mod:`.plumbing`: errors to statuses, bodies, counting, the fast
routes), the connection tuning under uvicorn (:mod:`.connection`), the routes of each
protocol (:mod:`.kserve`, :mod:`.openai_api`, :mod:`.task_routes`), a repository's
routes (:mod:`.repository_routes`), the API-key door (:mod:`.auth`) and the app factory
(:mod:`.app`). It never imports :mod:`ortbatch.serve.grpc`.
"""
