"""Agents the kernel can step (shell, loop, pane, llm, agentcli). Import kernel only."""
