"""Visual models' routes: images and videos."""
