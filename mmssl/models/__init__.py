"""Models: the masked ViT encoder shared by MAE and masked CLIP (FLIP), and the LightningModules."""
