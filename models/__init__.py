"""Models: the zoo, users' factory files and Hugging Face loading. Nothing here captures or prices."""
