"""The protocol between a server and its clients: Messages, the Strategy and Client ABCs,
client profiles and the top-k upload codec. It imports nothing of fedtune above it."""
