"""Chat templates with tools, in the two formats ortbatch parses (written for these tests).

``HERMES``: ChatML turns; the tools listed as JSON inside ``<tools></tools>`` in the system
turn; a call is ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``; tool results
go back in a user turn inside ``<tool_response></tool_response>`` (the layout of Hermes 2 Pro and
Qwen 2.5 templates). ``LLAMA3``: Llama 3 headers; the tools as indented JSON in the first user
turn; a call is ``<|python_tag|>{"name": ..., "parameters": {...}}``; results come back in an
``ipython`` turn (the layout of Llama 3.1's JSON tool calling). ``PLAIN`` knows no tools.
"""

from __future__ import annotations

HERMES = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call functions. Their signatures are inside <tools></tools>:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}
{{- '\\n</tools>\\n\\nFor each call, answer with a JSON object inside <tool_call></tool_call> tags:\\n' }}
{{- '<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant' }}
{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}
{%- for call in message.tool_calls or [] %}
{%- set fn = call.function if call.function is defined else call %}
{{- '\\n<tool_call>\\n{"name": "' + fn.name + '", "arguments": ' + (fn.arguments | tojson) + '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}
"""

LLAMA3 = """\
{{- bos_token }}
{%- if not tools is defined %}{%- set tools = none %}{%- endif %}
{%- if messages[0].role == 'system' %}
{%- set system = messages[0].content %}{%- set messages = messages[1:] %}
{%- else %}{%- set system = '' %}{%- endif %}
{{- '<|start_header_id|>system<|end_header_id|>\\n\\n' }}
{%- if tools is not none %}{{- 'Environment: ipython\\n' }}{%- endif %}
{{- system + '<|eot_id|>' }}
{%- for message in messages %}
{%- if loop.first and tools is not none and message.role == 'user' %}
{{- '<|start_header_id|>user<|end_header_id|>\\n\\nAnswer a function call as JSON: ' }}
{{- '{"name": function name, "parameters": dictionary of arguments}. The functions:\\n\\n' }}
{%- for t in tools %}{{- t | tojson(indent=4) + '\\n\\n' }}{%- endfor %}
{{- message.content + '<|eot_id|>' }}
{%- elif message.role == 'assistant' and message.tool_calls %}
{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n<|python_tag|>' }}
{%- for call in message.tool_calls %}
{%- if not loop.first %}{{- '; ' }}{%- endif %}
{{- '{"name": "' + call.function.name + '", "parameters": ' + (call.function.arguments | tojson) + '}' }}
{%- endfor %}
{{- '<|eom_id|>' }}
{%- elif message.role == 'tool' %}
{{- '<|start_header_id|>ipython<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- else %}
{{- '<|start_header_id|>' + message.role + '<|end_header_id|>\\n\\n' + message.content + '<|eot_id|>' }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}
"""

PLAIN = """\
{%- for message in messages %}{{- message.role + ': ' + message.content + '\\n' }}{%- endfor %}
{%- if add_generation_prompt %}{{- 'assistant: ' }}{%- endif %}
"""

#: A template that reads ``tools`` but calls them in a format ortbatch does not parse.
XML_CALLS = (
    """\
{%- if tools %}{{- 'Tools: ' + (tools | tojson) + '\\nCall as <invoke name="..."></invoke>\\n' }}{%- endif %}
"""
    + PLAIN
)
