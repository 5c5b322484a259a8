"""The guest agent of the runv backend and its wire protocol (see PROTOCOL.md)."""
