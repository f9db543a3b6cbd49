"""The serving core, transport-neutral: what is served (:class:`~.model.ServedModel`,
:class:`~.generator.ServedGenerator`, the text-in view), the repository lifecycle, the
KServe v2 wire format, the completion and text-task logic, and the one model lookup.

Nothing here knows HTTP or gRPC: the transports (:mod:`ortbatch.serve.http`,
:mod:`ortbatch.serve.grpc`) call it, and map its errors (:mod:`ortbatch.errors`) onto
their statuses once each.
"""
