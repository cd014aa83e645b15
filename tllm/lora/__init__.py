"""Multi-LoRA serving: adapter requests (`request`, plain data), PEFT adapter folders
(`adapter`), the adapters' stacked weights inside the model's linear layers (`layers`) and
the adapter slots as a resource manager (`manager`). Import the modules directly: this
package imports nothing, so that plain data (`tllm.lora.request`) stays at the bottom layer."""
