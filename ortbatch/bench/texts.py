"""A small built-in corpus for ``--lengths texts``: search queries, support tickets, product
reviews and documentation paragraphs, so token lengths spread the way an embedding service's
traffic does (many short, a long tail). Written for ortbatch; no external data set."""

from __future__ import annotations

__all__ = ["TEXTS"]

TEXTS: tuple[str, ...] = (
    "how do I reset my password",
    "cheap flights to lisbon in march",
    "best budget laptop for students",
    "python list comprehension with condition",
    "symptoms of vitamin d deficiency",
    "what time does the pharmacy close on sunday",
    "convert celsius to fahrenheit",
    "is the new firmware update safe to install",
    "onnx runtime dynamic batching",
    "why is my sourdough starter not rising",
    "train delays between utrecht and amsterdam today",
    "refund status for order 88123",
    "The package arrived two days late and the box was crushed, but the headphones inside work fine.",
    "Great battery life. I charge it once a week and the screen is still bright outdoors.",
    "The app logs me out every time I switch networks, which makes it useless on the train.",
    "Customer asks whether the annual plan can be paused during parental leave without losing "
    "the discounted price they signed up with last year.",
    "After updating to version 4.2 the export button is greyed out for every project that was "
    "created before the update; new projects are fine.",
    "Our warehouse scanner reports the wrong quantity when two labels are scanned within one second "
    "of each other. We reproduced it on three devices with the same result.",
    "The hotel was clean and quiet, the staff friendly, and breakfast had plenty of choice. The only "
    "downside was the twenty minute walk to the nearest metro station.",
    "I would like to change the delivery address for my subscription starting next month.",
    "Can someone explain the difference between a mutex and a semaphore in simple terms?",
    "Photosynthesis converts light energy into chemical energy stored in glucose.",
    "The meeting has been moved to Thursday at 3 pm in the large conference room.",
    "Please find attached the signed contract and the invoice for the first quarter.",
    "A dynamic batcher collects requests that arrive close together and runs them as one batch, "
    "trading a little latency for much higher throughput when the hardware is underused by single "
    "requests. Padding every request to the longest in its batch wastes compute, so good batchers "
    "group requests of similar length and cap the padded size of a batch rather than its row count.",
    "To install the command line tool, download the archive for your platform, unpack it into a "
    "directory on your PATH, and run the setup command once to create the configuration file. The "
    "tool reads its settings from that file on every start, and any option can be overridden on the "
    "command line. Logs are written to the state directory and rotated daily.",
    "The river rose quickly after three days of rain. By the second evening the footbridge near the "
    "mill was under water, and the village council closed the lower road. Volunteers filled sandbags "
    "in the school yard while the fire brigade pumped out the cellars along the quay. Nobody was hurt, "
    "but the bakery lost a week of flour and the football pitch will need new turf before spring.",
    "Quarterly results: revenue grew eleven percent year on year, driven by subscriptions in Europe "
    "and a recovery in hardware sales in the second half. Operating costs rose faster than planned "
    "because of a one-off migration of the billing system, which is now complete. Guidance for the "
    "full year is unchanged. The board proposes a dividend in line with last year and will present "
    "the new three-year plan at the investor day in October, including targets for margin and for "
    "the share of recurring revenue.",
    "Transformers process a sequence of tokens with layers of self-attention, in which every token "
    "attends to every other token, followed by position-wise feed-forward networks. The cost of "
    "attention grows with the square of the sequence length, while the feed-forward layers grow "
    "linearly, so for short inputs the feed-forward layers dominate and for long inputs attention "
    "does. Encoder models such as BERT produce one vector per token; a pooling step averages them "
    "into a single sentence embedding that can be compared with cosine similarity for search, "
    "clustering and deduplication.",
    "thanks, that fixed it",
    "order never arrived",
    "where is the nearest charging station",
    "translate good morning into japanese",
    "What are the opening hours of the city library during the summer holidays?",
    "Is it possible to book a table for eight people on Friday evening with a vegetarian menu?",
    "The printer on the third floor keeps jamming when printing double-sided documents.",
    "Our new onboarding checklist covers accounts, hardware, security training and a first-week "
    "buddy, and every new hire should finish it before their second Monday.",
    "The sensor readings drift by about half a degree per hour when the enclosure is in direct "
    "sunlight, so we added a shade and a correction based on the internal temperature probe.",
)
