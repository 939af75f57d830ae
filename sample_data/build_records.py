"""Writes llava_sample.json: conversations written for this project about the bundled photos.

Run from the repository root: python sample_data/build_records.py
"""

import json
from pathlib import Path

H, G = "human", "gpt"


def turn(speaker, text):
    return {"from": speaker, "value": text}


RECORDS = [
    {"id": "astronaut-0", "image": "astronaut.jpg", "conversations": [
        turn(H, "<image>\nWho or what is shown in this photo?"),
        turn(G, "A smiling astronaut in a white spacesuit poses in front of a flag, holding a helmet on one arm."),
    ]},
    {"id": "astronaut-1", "image": "astronaut.jpg", "conversations": [
        turn(H, "What colours dominate the picture?\n<image>"),
        turn(G, "White from the suit, blue from the background and the red and white stripes of the flag."),
        turn(H, "Is this photo taken indoors or outdoors?"),
        turn(G, "It looks like an indoor studio portrait: the light is even and the background is a plain backdrop."),
    ]},
    {"id": "coffee-0", "image": "coffee.jpg", "conversations": [
        turn(H, "<image>\nDescribe the image in detail."),
        turn(G, "A cup of coffee sits on a saucer on a wooden table. The coffee has a light layer of foam, "
                "a spoon rests on the saucer, and the background is softly out of focus."),
    ]},
    {"id": "coffee-1", "image": "coffee.jpg", "conversations": [
        turn(H, "<image>\nWould this drink be hot or cold? Explain briefly."),
        turn(G, "Most likely hot: it is served in a ceramic cup with a saucer and has crema on top, "
                "as an espresso-based drink does."),
    ]},
    {"id": "chelsea-0", "image": "chelsea.jpg", "conversations": [
        turn(H, "<image>\nWhat animal is this?"),
        turn(G, "A cat with a striped tabby coat, looking slightly to the side."),
    ]},
    {"id": "chelsea-1", "image": "chelsea.jpg", "conversations": [
        turn(H, "<image>\nWrite a short caption for this photo."),
        turn(G, "A curious tabby cat pauses for a portrait."),
        turn(H, "Now make it funny."),
        turn(G, "A tabby cat wondering why the human is pointing a box at her instead of opening the food."),
    ]},
    {"id": "rocket-0", "image": "rocket.jpg", "conversations": [
        turn(H, "<image>\nWhat is happening in this picture?"),
        turn(G, "A rocket stands on its launch pad, ready for launch, surrounded by towers and equipment."),
    ]},
    {"id": "rocket-1", "image": "rocket.jpg", "conversations": [
        turn(H, "<image>\nWhat could the tall towers next to the vehicle be for?"),
        turn(G, "They are launch towers: they hold fuel lines and cables, give access to the vehicle, "
                "and some of them protect the pad from lightning."),
    ]},
    {"id": "hubble-0", "image": "hubble_deep_field.jpg", "conversations": [
        turn(H, "<image>\nWhat are the small bright objects in this image?"),
        turn(G, "Almost all of them are distant galaxies; a few sharp points with spikes are foreground stars. "
                "This kind of deep field image shows how many galaxies fill even a tiny patch of sky."),
    ]},
    {"id": "hopper-0", "image": "grace_hopper.jpg", "conversations": [
        turn(H, "<image>\nDescribe the person in the photo."),
        turn(G, "A woman in a dark naval uniform with insignia on the sleeves and a white collar, "
                "posing for a formal portrait in front of a plain background."),
    ]},
    {"id": "hopper-1", "image": "grace_hopper.jpg", "conversations": [
        turn(G, "Hello! Ask me anything about the image."),
        turn(H, "<image>\nWhat kind of photograph is this?"),
        turn(G, "A formal official portrait, like those taken for military records."),
    ]},
    {"id": "logo-0", "image": "logo.png", "conversations": [
        turn(H, "<image>\nWhat is shown here?"),
        turn(G, "A logo: a stylised drawing with the words scikit image, on a transparent background."),
    ]},
    {"id": "pair-0", "image": ["coffee.jpg", "chelsea.jpg"], "conversations": [
        turn(H, "First image: <image>\nSecond image: <image>\nWhat do the two images have in common?"),
        turn(G, "Both are close-up photos with a single subject in the centre and a blurred background: "
                "a cup of coffee in the first, a cat in the second."),
    ]},
    {"id": "pair-1", "image": ["rocket.jpg", "astronaut.jpg"], "conversations": [
        turn(H, "<image>\n<image>\nHow are these two pictures related?"),
        turn(G, "Both are about space flight: the first shows a launch vehicle on its pad, "
                "the second an astronaut in a spacesuit."),
    ]},
    {"id": "text-0", "conversations": [
        turn(H, "What is sequence packing?"),
        turn(G, "Sequence packing puts several short training samples into one long sequence, so that "
                "the model sees fewer padding tokens and the GPU does more useful work per step."),
    ]},
    {"id": "text-1", "conversations": [
        turn(H, "Give me three tips for writing clear error messages."),
        turn(G, "Say what was wrong, show the value that caused it, and tell the reader how to fix it."),
        turn(H, "And one more?"),
        turn(G, "Keep it on one line, so it stays readable in logs."),
    ]},
    {"id": "text-2", "conversations": [
        turn(H, "Translate to French: the cat is sleeping on the chair."),
        turn(G, "Le chat dort sur la chaise."),
    ]},
    {"id": "text-3", "conversations": [
        turn(H, "Explain in one sentence why images are stored as uint8 before normalisation."),
        turn(G, "One byte per value is four times smaller than float32, and normalising later gives exactly "
                "the same numbers."),
    ]},
    {"id": "hubble-1", "image": "hubble_deep_field.jpg", "conversations": [
        turn(H, "Count roughly how many objects you can see.\n<image>"),
        turn(G, "Several hundred: most are faint, small smudges spread across the whole frame."),
    ]},
    {"id": "chelsea-2", "image": "chelsea.jpg", "conversations": [
        turn(H, "<image>\nIs the cat awake?"),
        turn(G, "Yes, its eyes are open and it seems alert."),
    ]},
]


def main():
    path = Path(__file__).with_name("llava_sample.json")
    path.write_text(json.dumps(RECORDS, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    print(f"wrote {len(RECORDS)} records to {path}")


if __name__ == "__main__":
    main()
