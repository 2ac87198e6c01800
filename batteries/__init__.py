"""Port implementations (audit, critic, budget, checkpoint, delivery). Import kernel only."""
